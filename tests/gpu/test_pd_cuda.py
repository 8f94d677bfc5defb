"""On a CUDA GPU: 1P1D with the reference engine on CUDA, KV registered as VRAM, both workers on
one GPU, passes the equality test against aggregated serving. Skipped without a GPU."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("nixl")

from tests.integration.test_pd_equality import prompts, run_all  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402

CUDA_ARGS = ["--device", "cuda:0", "--page-size", "16", "--num-pages", "2048"]


@pytest.mark.gpu
def test_pd_on_cuda_equals_agg(tiny_model, tmp_path):
    outputs = {}
    for shape, roles in (("agg", ["agg"]), ("pd", ["prefill", "decode"])):
        c = Cluster(tiny_model, str(tmp_path / shape))
        (tmp_path / shape).mkdir()
        for role in roles:
            extra = ["--role", role, *CUDA_ARGS]
            if role == "prefill":
                extra += ["--bootstrap-port", str(free_port())]
            c.add_worker("reference", extra)
        try:
            addrs = [w.address for w in c.workers]
            outputs[shape] = {s: asyncio.run(run_all(addrs, 64, s)) for s in (False, True)}
            c.start_frontend()
            c.assert_idle()
        finally:
            c.stop()
    for seeded in (False, True):
        bad = [i for i, (a, b) in enumerate(zip(outputs["pd"][seeded], outputs["agg"][seeded]))
               if a != b]
        assert not bad, f"seeded={seeded}: {len(bad)} of {len(prompts())} differ"
