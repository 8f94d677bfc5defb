"""The bootstrap protocol of a PD handoff: a decode worker sends a prefill worker the pages to
write (decode.py), the prefill side answers when they are written (prefill.py), both check what
the other sent (checks.py)."""
