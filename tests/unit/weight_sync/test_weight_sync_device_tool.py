"""tools/weight_sync_device.py on the host: its bucket is packed and checksummed by the same code a
GPU sender runs, and it refuses to report if the device checksum disagrees with the host's."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import weight_sync_device as tool  # noqa: E402

from megatron_apriel.weight_sync import buckets as B  # noqa: E402


def test_smoke_run_reports_every_figure_against_both_links():
    result = tool.measure(torch.device("cpu"), 24 << 20, repeats=1)
    assert result["tensors"] == 8  # 1, 2, 4, 8, 1, 2, 4 MiB (22), then the last one trimmed to 2
    assert set(result["gb_s"]) == {"pack", "checksum", "pack_checksum", "checksum_direct"}
    assert set(result["fraction_of_link_time"]) == {"nvlink4", "nic_400gbps"}
    assert all(v > 0 for v in result["gb_s"].values())


def test_a_wrong_device_checksum_stops_the_tool(monkeypatch):
    monkeypatch.setattr(B, "checksum_on_device", lambda data: torch.tensor(12345, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="disagrees"):
        tool.measure(torch.device("cpu"), 4 << 20, repeats=1)
