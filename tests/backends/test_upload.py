"""`upload`: a snapshot's host arrays reach the device as tensors of their own dtypes, in one
copy the host does not wait for; `host_metadata` puts a backend's own arrays in that copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_cases import make_case

from engine.backends.base import host_metadata, upload

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_upload_keeps_values_and_dtypes(device):
    arrays = {
        "a": np.arange(5, dtype=np.int32),  # 20 bytes: the next array starts past padding
        "b": np.array([2**40, -3], dtype=np.int64),
        "empty": np.zeros(0, dtype=np.int64),
        "c": np.linspace(0, 1, 7, dtype=np.float32),
    }
    for array in arrays.values():
        array.setflags(write=False)  # as a snapshot's arrays are
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a blocking copy would raise
    try:
        tensors = upload(device, arrays)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert tensors.keys() == arrays.keys()
    for name, array in arrays.items():
        tensor = tensors[name]
        assert tensor.device.type == device and tensor.shape == array.shape
        assert tensor.dtype == torch.from_numpy(np.empty(0, array.dtype)).dtype
        assert np.array_equal(tensor.cpu().numpy(), array)
    tensors["a"][0] = 99  # a copy, not a view of the snapshot's array
    assert arrays["a"][0] == 0


def test_host_metadata_refuses_an_extra_array_named_as_its_own():
    case = make_case("extend", [3], [2], 1, 1, 16, torch.float32, seed=0)
    meta, more = host_metadata(case.batch, "cpu", {"rows": np.zeros(1, np.int64)})
    assert more["rows"].tolist() == [0] and meta["out_slots"].tolist() == list(case.batch.out_slots)
    with pytest.raises(ValueError, match="out_slots"):
        host_metadata(case.batch, "cpu", {"out_slots": np.zeros(2, np.int64)})
