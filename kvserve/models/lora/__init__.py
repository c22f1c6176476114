"""LoRA adapters on a loaded model: PEFT directories read and checked (`adapter.py`), each
projection's adapters stacked in slots and applied per row group of a step (`slots.py`), and
the model-wide table of which adapter sits in which slot (`model_lora.py`)."""

from kvserve.models.lora.adapter import LoRAAdapter, read_peft_adapter
from kvserve.models.lora.model_lora import ModelLoRA

__all__ = ["LoRAAdapter", "ModelLoRA", "read_peft_adapter"]
