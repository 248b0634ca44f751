"""A GRPO smoke run (launch/train.py's ``run``, Ray worker groups, tiny random model) with LoRA, its rollouts served by
vLLM (the converted-weights sync; the native engine where vLLM is not installed): the updates have non-zero
gradients, the checkpoint holds only the adapters and their optimizer state, and after the first update moved the
adapters, step 2's sampler log-probs still match the trainer's recomputation with base + adapters merged (a sync of
the bare base would miss by the adapters' effect; ``actor/ppo_kl`` shows how far the policy moved). That the base
stays bit-identical and the native engine serves the merged weights is tests/test_workers_lora.py."""

from __future__ import annotations

import ast
import importlib.util
import json

import pytest

pytestmark = pytest.mark.slow

PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the decoded response has an even number of characters: random text passes about half the time."""
    return float(len(solution_str) % 2 == 0)
'''


def test_grpo_smoke_run_with_lora_trains_and_serves_only_adapters(tmp_path):
    from jaxrl_hf.trainer import run

    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "jax"
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)
    run_dir = tmp_path / "run"
    try:
        assert run("grpo", preset="smoke", overrides=[
            f"trainer.run_dir={run_dir}", f"custom_reward_function.path={scorer}", "trainer.val_before_train=false",
            f"rollout.name={engine}", "model.tiny.head_dim=32", "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=64", "actor_rollout_ref.model.target_modules=[q_proj,v_proj,up_proj]",
            "actor_rollout_ref.actor.optim.lr=5e-2"]) == 0
    finally:
        import ray
        if ray.is_initialized():
            ray.shutdown()
    with open(run_dir / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    updates = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in updates)  # mixed rewards: the adapters get gradients
    assert updates[0]["actor/ppo_kl"] > 1e-2  # the first update moved the policy
    assert updates[1]["rollout_corr/mismatch_abs_logprob_diff"] < 1e-4  # the engine serves base + adapters

    state_dir = run_dir / "checkpoints" / "global_step_2" / "actor" / "state"
    with open(state_dir / "_METADATA") as fh:
        paths = [ast.literal_eval(k) for k in json.load(fh)["tree_metadata"]]
    params = {p[2:] for p in paths if p[:2] == ("train_state", "params")}
    assert params == {(m, w) for m in ("q_proj", "v_proj", "up_proj") for w in ("lora_A", "lora_B")}
    assert not any("embed_tokens" in p or "kernel" in p for path in paths for p in path)  # no base weights saved
