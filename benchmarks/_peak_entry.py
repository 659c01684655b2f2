"""The real pretrain entry point, plus a line at exit with this rank's peak memory.

benchmarks.memory_phases runs this under torchrun instead of pretrain_dit_model.py: the training
is the entry point's own (``runpy``); at interpreter exit each rank appends one JSON line
``{"rank", "peak_rss", "cuda_peak"}`` to the file named by ``DFM_PEAK_FILE`` (peak RSS from
``getrusage``, exact, in bytes; ``torch.cuda.max_memory_allocated`` when CUDA was used).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[1] / "examples" / "megatron" / "recipes" / "dit" / "pretrain_dit_model.py"


def write_peak() -> None:
    import torch

    cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "cuda_peak": cuda_peak,
    }
    if os.environ.get("DFM_PHASE_TRACE"):
        import _phase_trace  # next to this file

        _phase_trace.mark("exit")
        record |= {"peak_rss": _phase_trace.overall_peak(), "phases": _phase_trace.PHASES}
    with open(os.environ["DFM_PEAK_FILE"], "a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    atexit.register(write_peak)
    if os.environ.get("DFM_PHASE_TRACE"):
        import _phase_trace  # next to this file

        _phase_trace.install()
    sys.argv[0] = str(ENTRY)
    runpy.run_path(str(ENTRY), run_name="__main__")
