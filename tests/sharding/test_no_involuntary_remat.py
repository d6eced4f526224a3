"""The compiled train step must not make XLA replicate whole tensors to reach a sharding.

XLA's SPMD partitioner prints "Involuntary full rematerialization" (from C++, on file descriptor 2) when it can
only reach a sharding by replicating a whole tensor and slicing it again. Compiling the trainer's train step
printed it for FSDP 4 + TP-transpose 2 (a weight split over (fsdp, tensor_transpose) on its input dim, used
split over tensor_transpose on its output dim: dense MLP and expert weights) and for FSDP 4 + EP-as-CP 2 (rows
looked up in a width-split embedding table, then split over batch and sequence at once), in both mesh modes.
These cases compile (lower + compile, nothing runs) a one-MoE-layer model with batch split and an MTP head, the
smallest model that still printed the warnings before the fix (7 to 12 per case), and assert none.
benchmarks/compiled_programs.py counts them for every layout of the explicit-vs-auto benchmark.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compiled_programs as cp  # noqa: E402

TINY = dict(layers=1, vocab=256, first_k_dense_replace=0, hidden_size=32, intermediate_size=64,
            moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8)
LAYOUTS = ("FSDP 4 + TP-transpose 2", "FSDP 4 + EP-as-CP 2 (ep-as-cp)")


@pytest.mark.parametrize("mode", cp.MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_train_step_compiles_without_involuntary_rematerialization(layout, mode):
    config = cp.case_config(layout, "split+mtp", **TINY)
    _, stderr, _ = cp.compile_case(config, layout, mode, batch=16, seq=16)
    warnings = cp.remat_warnings(stderr)
    assert not warnings, f"{len(warnings)} involuntary full rematerializations:\n" + "\n".join(
        cp.warning_site(w) for w in warnings)


def test_the_capture_sees_xla_warnings():
    """The stderr capture reads what C++ writes to file descriptor 2 (so an empty list above means no warning)."""
    import os

    with cp.captured_stderr() as err:
        os.write(2, b"W0000 spmd_partitioner.cc] [SPMD] Involuntary full rematerialization. test line\n")
    assert len(cp.remat_warnings(err[0])) == 1


def test_collective_bytes_counts_loop_trips():
    """A collective inside a while loop of known trip count 3 is counted 3 times, with ring traffic."""
    hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8]{0} all-gather(f32[2]{0} %x), replica_groups=[2,4]<=[8], dimensions={0}
  %ar = f32[8]{0} all-reduce(f32[8]{0} %ag), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %a), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}
"""
    got = cp.collective_bytes(hlo, 8)
    assert got["all-gather"] == pytest.approx(3 * 32 * 3 / 4)  # result 32 B, groups of 4
    assert got["all-reduce"] == pytest.approx(3 * 2 * 32 * 1 / 2)  # groups of 2
    assert got["reduce-scatter"] == pytest.approx(8 * 3)  # result 8 B, operand 32 B, groups of 4
