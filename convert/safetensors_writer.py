"""Write a safetensors file tensor by tensor, piece by piece, without holding its tensors in memory.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The format is simple enough to stream:
an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte range, then the raw
little-endian bytes in that order. Since every shape is known before conversion starts, the header is written first
and the data follows as it is produced; a fused expert tensor arrives one expert matrix at a time.
"""

import json
import struct
from pathlib import Path

import torch


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class StreamingSafetensorsWriter:
    def __init__(self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        """`layout`: (name, dtype, shape) of every tensor, in the order their bytes will be written."""
        header, offset = {"__metadata__": metadata}, 0
        self._ends = []
        for name, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            self._ends.append((name, dtype, offset))
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8-byte alignment
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        self._written = 0
        self._current = 0  # index into layout of the tensor being written
        self._skip_finished()

    def _skip_finished(self):
        # Move past tensors whose bytes are complete (empty tensors are complete before any write).
        while self._current < len(self._ends) and self._ends[self._current][2] == self._written:
            self._current += 1

    def write(self, piece: torch.Tensor):
        """Append the next piece of the current tensor (pieces are concatenated in C order)."""
        if self._current == len(self._ends):
            raise ValueError("every tensor of this file is already written")
        name, dtype, end = self._ends[self._current]
        if piece.dtype != dtype:
            raise ValueError(f"{name}: got a {piece.dtype} piece for a {dtype} tensor")
        data = piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > end:
            raise ValueError(f"{name}: more data than its shape holds")
        self._file.write(data)
        self._written += data.nbytes
        self._skip_finished()

    def close(self):
        self._file.close()
        if self._current != len(self._ends):
            raise ValueError(f"{self._ends[self._current][0]} was not written completely")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
        else:
            self._file.close()
