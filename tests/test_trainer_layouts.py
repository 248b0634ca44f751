"""The training layout is a rule set chosen by config, not a second code path: the same GRPO smoke step through
``launch/train.py``'s trainer, Ray and the worker groups on 4 host devices logs the same loss, gradient norm and
score under ``strategy=megatron`` dp4, ``strategy=fsdp`` dp4 (ZeRO-3: params, grads and Adam moments sharded
over dp), fsdp over dp2 x tp2 (``fsdp_tp``), fsdp over dp2 x Ulysses sp2 (``fsdp_sp``: each pair of devices
holds the same rows, each half of every sequence; ZeRO-3 over all 4) and fsdp dp4 with packed sequences in
token-budget micro-batches (``use_remove_padding`` + ``use_dynamic_bsz``), written with verl's keys. Micro-batches
accumulate exactly (token-mean over the mini-batch), so the numbers agree up to float reduction order."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

# One mini-batch per step (all 4 prompts), two epochs: each update is one optimizer step over the same rows however
# dp splits them (with several mini-batches, which rows form a mini-batch depends on dp, as in verl); the second
# epoch makes pg_loss, ppo_kl and pg_clipfrac non-trivial (off-policy after the first update).
FOUR_DEVICES = ["placement.devices_per_process=4", "actor.ppo_mini_batch_size=4",
                "actor.ppo_micro_batch_size_per_device=1", "actor.ppo_epochs=2",
                "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.save_freq=0"]
LAYOUTS = {
    "megatron_dp4": ["actor_rollout_ref.actor.strategy=megatron", "placement.train.dp=4"],
    "fsdp_dp4": ["actor_rollout_ref.actor.strategy=fsdp", "placement.train.dp=4"],
    "fsdp_dp2_tp2": ["actor_rollout_ref.actor.strategy=fsdp", "placement.train.dp=2", "placement.train.tp=2"],
    # verl: world 4, ulysses_sequence_parallel_size 2 -> 2 data-parallel groups of 2 (placement.train.dp counts all 4)
    "fsdp_dp2_sp2": ["actor_rollout_ref.actor.strategy=fsdp", "placement.train.dp=4",
                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
    # packed sequences in token-budget micro-batches (the smoke preset's rows are at most 64 + 16 = 80 tokens)
    "fsdp_dp4_packed": ["actor_rollout_ref.actor.strategy=fsdp", "placement.train.dp=4",
                        "actor_rollout_ref.model.use_remove_padding=True",
                        "actor_rollout_ref.actor.use_dynamic_bsz=True",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96"],
}
PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the decoded response has an even number of characters: random text passes about half the time."""
    return float(len(solution_str) % 2 == 0)
'''
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy",
            "critic/score/mean", "response_length/mean")


def test_layouts_log_the_same_step(tmp_path):
    from jaxrl_hf.trainer import run

    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)  # non-zero advantages, so the step has a policy gradient to compare
    records = {}
    for name, layout in LAYOUTS.items():
        run_dir = tmp_path / name
        overrides = [f"trainer.run_dir={run_dir}", f"custom_reward_function.path={scorer}", *FOUR_DEVICES, *layout]
        assert run("grpo", preset="smoke", overrides=overrides) == 0
        with open(run_dir / "metrics.jsonl") as fh:
            records[name] = [json.loads(line) for line in fh if line.strip()]
        assert [r["step"] for r in records[name]] == [1]
    reference = records["megatron_dp4"][0]
    assert reference["actor/grad_norm"] > 0 and reference["actor/pg_loss"] != 0 and reference["actor/pg_clipfrac"] > 0
    for name in ("fsdp_dp4", "fsdp_dp2_tp2", "fsdp_dp2_sp2"):
        for key in COMPARED:
            assert records[name][0][key] == pytest.approx(reference[key], rel=1e-4, abs=1e-7), (name, key)
    # other micro-batches (by tokens, not rows): the same loss and gradient; ratio metrics average per micro-batch
    packed = records["fsdp_dp4_packed"][0]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert packed[key] == pytest.approx(reference[key], rel=1e-3, abs=1e-7), key
    assert 0 <= packed["actor/padding_ratio"] < 1
