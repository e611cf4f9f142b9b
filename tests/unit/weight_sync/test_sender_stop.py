"""A stop request ends the weight sender's wait for a fleet that no longer answers (the servers are
stopping with the trainer) on every rank, instead of waiting out ``weight_sync.timeout_s``."""

import pytest

from megatron_apriel.convert.hf_io import HFReader
from megatron_apriel.convert.mapping import detect_layout
from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.parallel.rendezvous import free_port, single_process_world
from megatron_apriel.stop import StopRequested
from megatron_apriel.tiny.model import build_tiny_model
from megatron_apriel.weight_sync.config import WeightSyncConfig
from megatron_apriel.weight_sync.gather import table_to_hf
from megatron_apriel.weight_sync.sender import WeightSender


@pytest.mark.parametrize("stopping", [True, False])
def test_a_stop_request_ends_the_wait_for_a_silent_fleet(tmp_path, stopping):
    base = build_tiny_model(tmp_path / "base")
    arch = ModelArch.from_hf_dir(base)
    reader = HFReader(base)
    nobody = f"http://127.0.0.1:{free_port()}"  # no server listens there
    with single_process_world() as ctx:
        model = build_model(ModelConfig(hf_path=str(base)), ctx)
        sender = WeightSender(WeightSyncConfig(timeout_s=5.0), members=[nobody], model=model, ctx=ctx,
                              vocab_size=arch.vocab_size,
                              to_hf=table_to_hf(arch, detect_layout(reader.files.keys(), reader.config)),
                              should_stop=lambda: stopping)
        expected = StopRequested if stopping else RuntimeError  # RuntimeError: "no vLLM server ... answered for 5.0s"
        with pytest.raises(expected):
            sender.push(version=1)
        sender.close()
