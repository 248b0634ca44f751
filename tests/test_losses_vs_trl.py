"""One given batch through both trainers: our actor's update against TRL's ``GRPOTrainer`` loss on the same weights.

The learning comparison (`launch/bench/bench_learning_vs_trl.py`, docs/LEARNING_VS_TRL.md) maps ``token-mean`` to
TRL's ``loss_type="dapo"`` and ``seq-mean-token-mean`` to ``"grpo"``. Here the mapping is checked where sampling
plays no part: the same tiny random Llama (an HF directory, loaded by our actor worker and by transformers), the same
16 rows (4 prompts x 4 samples, left-padded prompts, right-padded responses of random lengths), the same advantages.
Our side is the real actor worker (8 fake CPU devices, dp 4 x tp 2; 4 micro-batches of a row accumulated, or one
micro-batch of a whole group a device as in the learning bench: the shared-prompt forward / one packed row per
group), padded and packed (``model.use_remove_padding``); TRL's side is its own ``GRPOTrainer.compute_loss`` in float32, then
``torch.optim.AdamW`` (TRL's optimizer) for one step. The loss, the gradient norm before clipping and the parameter
change of the one AdamW step must agree to float32 accuracy.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from _models_helpers import DP4_TP2_PLACEMENT, local_actor, random_prompts, tiny_config, tiny_worker_config, \
    write_tiny_hf_dir
from jaxrl_hf.controller import Batch
from jaxrl_hf.models.weights_hf import params_to_hf_state_dict

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

MODEL = tiny_config(vocab_size=96, hidden_size=32, head_dim=8, max_position_embeddings=128)
PROMPTS, N, P, R = 4, 4, 6, 8
LR, EPS_LOW, EPS_HIGH = 1e-3, 0.2, 0.28
LOSS_TYPE_OF_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny HF model directory (random weights, a word-level tokenizer) both trainers load."""
    return write_tiny_hf_dir(tmp_path_factory.mktemp("losses_vs_trl") / "model", MODEL, seed=3)


@pytest.fixture(scope="module")
def rollout():
    """16 rows: left-padded prompts, right-padded responses (1..R tokens), and GRPO advantages of binary rewards
    normalised per group of 4 (one group all-wrong: advantage 0, as on the real task)."""
    rows = PROMPTS * N
    rng = np.random.default_rng(11)
    prompts, prompt_mask = random_prompts(5, rows, P, MODEL.vocab_size)
    responses = rng.integers(3, MODEL.vocab_size, (rows, R)).astype(np.int32)
    response_mask = (np.arange(R)[None] < rng.integers(1, R + 1, (rows, 1))).astype(np.int32)
    responses = responses * response_mask
    rewards = np.array([1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0], np.float32).reshape(PROMPTS, N)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    advantages = ((rewards - rewards.mean(axis=1, keepdims=True)) / (std + 1e-6)).reshape(rows)
    return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
            "advantages": advantages.astype(np.float32)}


@pytest.fixture(scope="module")
def grouped_rollout(rollout):
    """`rollout` with each group's 4 rows on one prompt, as a rollout makes them (consecutive rows of a group):
    the shared-prompt forward (padded) and one packed row per group (packed) take these."""
    prompts, prompt_mask = random_prompts(6, PROMPTS, P, MODEL.vocab_size)
    return {**rollout, "prompts": np.repeat(prompts, N, 0), "prompt_mask": np.repeat(prompt_mask, N, 0)}


def ours(model_dir: str, data: dict, loss_agg_mode: str, packed: bool,
         placement: dict = DP4_TP2_PLACEMENT, micro_rows: int = 1) -> tuple[dict, dict]:
    """Our actor worker's one update on ``data`` (``micro_rows`` rows a device per micro-batch): its metrics and
    each HF tensor's change."""
    worker = local_actor(tiny_worker_config(
        lr=LR, n=N, response_length=R, seed=0, placement=placement,
        model={"path": model_dir, "use_remove_padding": packed},
        actor={"ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_device": micro_rows,
               "log_prob_micro_batch_size_per_device": micro_rows, "loss_agg_mode": loss_agg_mode,
               "clip_ratio_low": EPS_LOW, "clip_ratio_high": EPS_HIGH, "use_kl_loss": False, "entropy_coeff": 0.0,
               "optim": {"weight_decay": 0.0}}))
    attention_mask = np.concatenate([data["prompt_mask"], data["response_mask"]], 1).astype(np.int32)
    batch = Batch.from_dict({
        "input_ids": np.concatenate([data["prompts"], data["responses"]], 1), "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, 1) - 1, 0).astype(np.int32),
        "responses": data["responses"], "response_mask": data["response_mask"],
        "advantages": (data["advantages"][:, None] * data["response_mask"]).astype(np.float32)})
    host = lambda: params_to_hf_state_dict(jax.tree.map(np.asarray, jax.device_get(worker.state.params)), MODEL)
    before = host()
    metrics = worker.update_actor(batch).meta_info["metrics"]
    after = host()
    return metrics, {name: after[name] - before[name] for name in before}


def trl_side(model_dir: str, data: dict, loss_type: str, tmp_path) -> tuple[dict, dict]:
    """TRL's ``GRPOTrainer.compute_loss`` on ``data`` (float32: ``bf16=False``, as the learning bench sets it;
    TRL's default is bf16 autocast), its gradient norm before clipping, and the
    change of one step of TRL's optimizer (``torch.optim.AdamW``, clipped to ``max_grad_norm``)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_vllm=False, use_cpu=True, report_to="none",
                          per_device_train_batch_size=PROMPTS * N, num_generations=N, max_completion_length=R,
                          bf16=False, fp16=False, loss_type=loss_type, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, beta=0.0, learning_rate=LR,
                          weight_decay=0.0, max_grad_norm=1.0, temperature=1.0, save_strategy="no")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=datasets.Dataset.from_list([{"prompt": "t3 t4"}] * (PROMPTS * N)),
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets: one micro-step
    t = {k: torch.as_tensor(v) for k, v in data.items()}
    inputs = {"prompt_ids": t["prompts"].long(), "prompt_mask": t["prompt_mask"].long(),
              "completion_ids": t["responses"].long(), "completion_mask": t["response_mask"].long(),
              "advantages": t["advantages"], "num_items_in_batch": t["response_mask"].sum()}
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    params = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grad_norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), args.max_grad_norm))
    optimizer = torch.optim.AdamW(list(params.values()), lr=LR, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=0.0)
    optimizer.step()
    delta = {n: (p.detach() - before[n]).numpy() for n, p in params.items()}
    entropy = trainer._metrics["train"]["entropy"][-1]
    return {"loss": float(loss.detach()), "grad_norm": grad_norm, "entropy": entropy}, delta


@pytest.mark.parametrize("loss_agg_mode", sorted(LOSS_TYPE_OF_AGG))
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout", ["rows", "groups"])
def test_one_batch_update_equals_trls(model_dir, rollout, grouped_rollout, loss_agg_mode, packed, layout, tmp_path):
    """dp 4 x tp 2 both: ``rows``, 4 micro-batches of one row a device; ``groups``, one micro-batch of a whole
    group a device, as the learning bench's micro-batches hold whole groups (the shared-prompt forward when
    padded, one packed row per group when packed)."""
    if layout == "rows":
        data = rollout
        got, got_delta = ours(model_dir, data, loss_agg_mode, packed)
    else:
        data = grouped_rollout
        got, got_delta = ours(model_dir, data, loss_agg_mode, packed, micro_rows=N)
        assert got["actor/packed_group_rows" if packed else "actor/shared_prompt_forward"] == 1.0  # the path taken
    ref, ref_delta = trl_side(model_dir, data, LOSS_TYPE_OF_AGG[loss_agg_mode], tmp_path)
    assert got["actor/num_updates"] == 1 and got["actor/pg_clipfrac"] == 0.0  # on-policy: the ratio is 1
    # float32 sums over <= 16 x 8 tokens through a 2-layer model: 1e-4 relative is ~100x float32 rounding
    np.testing.assert_allclose(got["actor/pg_loss"], ref["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["actor/grad_norm"], ref["grad_norm"], rtol=1e-4)
    if loss_agg_mode == "token-mean":  # TRL logs the token mean; verl (and we) aggregate it as the loss is
        np.testing.assert_allclose(got["actor/entropy"], ref["entropy"], rtol=1e-4)
    assert ref["grad_norm"] > 1e-3
    # One AdamW step from zero moments moves each weight by ~lr * g / (|g| + eps): the direction of every
    # gradient entry. Entries whose gradient is within float32 noise of 0 may go either way, so compare norms.
    names = sorted(ref_delta)
    a = np.concatenate([got_delta[n].ravel() for n in names])
    b = np.concatenate([ref_delta[n].ravel() for n in names])
    assert np.linalg.norm(a - b) < 2e-2 * np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)
