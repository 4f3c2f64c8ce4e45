"""`LoRARequest`: which adapter a request runs with (vLLM's shape: name, int id, path).

Pure Python, so the engine can carry it without importing torch. The int id is the adapter's
identity: it keys the adapter slots on the device and, through `lora_key`, the prefix-cache
block hashes, so two adapters never share KV blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 means no adapter), got {self.lora_int_id}"
            )
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path must be an adapter directory, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def lora_key(self) -> str:
        """The adapter's identity in block hashes and on the runner."""
        return f"lora:{self.lora_int_id}"
