"""What a prefill worker's bootstrap socket accepts from a decode peer (tandem.kv.bootstrap.decode): the
bounds that keep a `KvHello` from making the mover allocate or register gigabytes, and a `KvRoom`
from naming pages the peer does not have. Pure functions: each returns None, or why not in words
(which goes back to the peer in a `KvHelloReply` or `KvDone` error).

The caps are far above what a real worker announces (NIXL metadata is ~0.5 KB; a decode worker's
page count is its KV memory over its page size), and low enough that preparing a peer's
descriptors (24 bytes per page) stays in the tens of MB.
"""

from __future__ import annotations

from tandem.runtime import wire
from tandem.runtime.wire import KvHello, KvLayout, KvRoom

# A prefill side's answer to a room from a peer whose KvHello it does not hold (it restarted, or
# made room for other peers): the decode side says hello again and asks once more.
NO_HELLO = "no KvHello"
MAX_METADATA_BYTES = 64 * 1024
MAX_NAME_CHARS = 256
MAX_PEER_PAGES = 1 << 20  # pages a peer may announce (descriptors: 24 MiB at the cap)
MAX_ROOM_PAGES = 1 << 17  # pages one KvRoom may name
MAX_DEVICE = 1024
MEMORY_KINDS = ("DRAM", "VRAM", "SIM", "LOCAL")  # what tandem's movers announce
ADDRESS_LIMIT = 1 << 64


def check_hello(msg: KvHello, ours: KvLayout) -> str | None:
    """None if a peer announcing `msg` may be added to a mover whose own layout is `ours`."""
    if msg.version != wire.PROTOCOL_VERSION:
        return f"protocol version {msg.version} != {wire.PROTOCOL_VERSION}"
    if len(msg.decode_name) > MAX_NAME_CHARS:
        return f"decode name longer than {MAX_NAME_CHARS} characters"
    if not 0 < len(msg.agent_metadata) <= MAX_METADATA_BYTES:
        return f"agent metadata must have 1 to {MAX_METADATA_BYTES} bytes"
    return check_layout(msg.layout, ours)


def check_layout(layout: KvLayout, ours: KvLayout) -> str | None:
    if layout.page_bytes != ours.page_bytes:
        return f"peer pages are {layout.page_bytes} bytes, ours {ours.page_bytes}"
    if not 0 < layout.num_pages <= MAX_PEER_PAGES:
        return f"peer announces {layout.num_pages} pages; at most {MAX_PEER_PAGES}"
    if layout.base_addr < 0 or layout.base_addr + layout.page_bytes * layout.num_pages > \
            ADDRESS_LIMIT:
        return "peer's KV region is outside the 64-bit address space"
    if layout.mem not in MEMORY_KINDS:
        return f"unknown memory kind {layout.mem[:16]!r}"
    if not 0 <= layout.device < MAX_DEVICE:
        return f"device {layout.device} out of range"
    return None


def check_room(msg: KvRoom, layout: KvLayout) -> str | None:
    """None if `msg` names pages the peer (announced as `layout`) has, each once."""
    pages = msg.pages
    if msg.room < 0:
        return "room must not be negative"
    if not 0 < len(pages) <= min(MAX_ROOM_PAGES, layout.num_pages):
        return f"a room names 1 to {min(MAX_ROOM_PAGES, layout.num_pages)} pages, not {len(pages)}"
    if min(pages) < 0 or max(pages) >= layout.num_pages:
        return f"page index outside the peer's [0, {layout.num_pages})"
    if len(set(pages)) != len(pages):
        return "a page is named twice"
    if not 0 <= msg.skip <= MAX_ROOM_PAGES:
        return f"skip must be in [0, {MAX_ROOM_PAGES}], not {msg.skip}"
    return None
