"""What `--engine sglang` takes from tandem's worker config (`SGLangOptions`) and the SGLang flags
it makes of them (`server_argv`, `OWNED`: the SGLang settings tandem sets, which SGLang flags in
`engine_args` may not change). No sglang import here: tandem.engines.sglang, the one module that
imports sglang, parses these flags with SGLang's own argparse.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import WorkerConfig
from tandem.engines import sglang_cpu
from tandem.engines.base import EngineError
from tandem.runtime.wire import OutputMode, Role

__all__ = ["DISAGGREGATION_MODES", "OUTPUT_MODE", "OWNED", "SGLangOptions", "SGLangSetupError",
           "server_argv"]

DISAGGREGATION_MODES: dict[Role, str] = {"agg": "null", "prefill": "prefill", "decode": "decode"}
OUTPUT_MODE: OutputMode = "cumulative"  # SGLang's default, and so the adapter's


class SGLangSetupError(EngineError):
    """SGLang cannot be set up as asked (not installed, no GPU, a bad or conflicting flag)."""


@dataclass(frozen=True, slots=True)
class SGLangOptions:
    """What the adapter takes from tandem's worker config."""

    model: str
    role: Role = "agg"
    output_mode: OutputMode = OUTPUT_MODE
    page_size: int = WorkerConfig.page_size
    max_batch: int = 0  # -> --max-running-requests (0 = SGLang's own)
    num_pages: int = 0  # -> --max-total-tokens = num_pages * page_size (0 = SGLang's own)
    host: str = WorkerConfig.host  # the prefill's bootstrap server binds it (SGLang's --host)
    advertise_host: str = ""  # where decode engines reach the bootstrap server (default: host)
    bootstrap_port: int = 0  # prefill: SGLang's --disaggregation-bootstrap-port (0 = SGLang's)
    log_level: str = WorkerConfig.log_level
    device: str = WorkerConfig.device  # "" = SGLang's own (CUDA); "cpu": SGLang's CPU engine
    engine_args: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> SGLangOptions:
        return cls(model=cfg.model, role=cfg.role, output_mode=cfg.output_mode or OUTPUT_MODE,
                   page_size=cfg.page_size, max_batch=cfg.max_batch, num_pages=cfg.num_pages,
                   host=cfg.host, advertise_host=cfg.advertise_host,
                   bootstrap_port=cfg.bootstrap_port, log_level=cfg.log_level,
                   device=cfg.device, engine_args=tuple(cfg.engine_args))

    @property
    def pool_pages(self) -> int:
        """SGLang's KV pool in pages (--max-total-tokens / page size; 0 = SGLang sizes it)."""
        cpu = sglang_cpu.is_cpu(self.device)
        return sglang_cpu.num_pages(self.num_pages, self.page_size) if cpu else self.num_pages


# --- the SGLang flags tandem sets -----------------------------------------------------------------

# SGLang dest -> (SGLang's flag, the tandem flag that sets it). When tandem's argv carries the flag
# (the output mode: always), engine_args may not change the value.
OWNED = {"model_path": ("--model-path", "--model"), "page_size": ("--page-size", "--page-size"),
         "disaggregation_mode": ("--disaggregation-mode", "--role"),
         "skip_tokenizer_init": ("--skip-tokenizer-init", "(none: tandem tokenizes)"),
         "incremental_streaming_output": ("--incremental-streaming-output", "--output-mode"),
         "max_running_requests": ("--max-running-requests", "--max-batch"),
         "max_total_tokens": ("--max-total-tokens", "--num-pages"),
         "device": ("--device", "--device"),
         "disaggregation_bootstrap_port": ("--disaggregation-bootstrap-port", "--bootstrap-port")}


def server_argv(opts: SGLangOptions) -> list[str]:
    """tandem's settings as SGLang flags (engine_args come after them)."""
    argv = ["--model-path", opts.model, "--page-size", str(opts.page_size),
            "--disaggregation-mode", DISAGGREGATION_MODES[opts.role], "--skip-tokenizer-init",
            "--host", opts.host, "--log-level", opts.log_level.lower()]
    if opts.output_mode == "incremental":
        argv.append("--incremental-streaming-output")
    if opts.role != "agg":
        argv += ["--disaggregation-transfer-backend", "nixl"]
    if opts.max_batch:
        argv += ["--max-running-requests", str(opts.max_batch)]
    if opts.pool_pages:
        argv += ["--max-total-tokens", str(opts.pool_pages * opts.page_size)]
    if sglang_cpu.is_cpu(opts.device):
        argv += sglang_cpu.flags(opts.role)
    elif opts.device:  # cuda, cuda:N
        argv += ["--device", "cuda"]
        if opts.device.startswith("cuda:"):
            argv += ["--base-gpu-id", opts.device.partition(":")[2]]
    if opts.bootstrap_port:
        argv += ["--disaggregation-bootstrap-port", str(opts.bootstrap_port)]
    return argv
