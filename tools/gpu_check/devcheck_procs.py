"""A custom logits processor written the way vLLM's docs write them: its state tensor lives on
`ProcessorInit.device`. gpu_check.py loads it as `devcheck_procs:DeviceBias` to probe whether the
logits that `apply` receives are on that device (they must be, for such a processor to work)."""

from __future__ import annotations

import torch

from kvserve.sample.logits_processor import AddedRow, PerRowProcessor, ProcessorInit

FORCED_TOKEN = 5


class DeviceBias(PerRowProcessor):
    """Rows whose extra_args has "force": true get +1e4 on FORCED_TOKEN (so greedy picks it)."""

    def __init__(self, init: ProcessorInit):
        super().__init__(init)
        self.bias = torch.zeros(init.vocab_size, device=init.device)
        self.bias[FORCED_TOKEN] = 1e4

    def is_argmax_invariant(self) -> bool:
        return False

    def row_state(self, row: AddedRow):
        return True if (row.params.extra_args or {}).get("force") else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.rows:
            logits[row] += self.bias
        return logits
