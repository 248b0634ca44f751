"""Driver data/reward plumbing with the real SmolLM2 tokenizer, and the plot script on a metrics file."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np

from jaxrl_hf.config import load_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.rewards import compute_score
from jaxrl_hf.trainer.data import collate_prompts, load_split, load_tokenizer, ptx_examples
from jaxrl_hf.trainer.scoring import RewardFunction

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompts_are_left_padded_chat_templates_and_rewards_land_on_the_last_token():
    cfg = load_config("dapo", preset="smoke", overrides=["reward_model.overlong_buffer.len=4"])
    tok = load_tokenizer(cfg.model.path)
    rows = load_split(cfg, "train", tok)["arithmetic"][:3]
    batch = collate_prompts(rows, tok, cfg.data.max_prompt_length, uid_base=500)
    assert batch["prompts"].shape == (3, cfg.data.max_prompt_length) and batch["uid"].tolist() == [500, 501, 502]
    for i, row in enumerate(rows):
        m = batch["prompt_mask"][i].astype(bool)
        assert not m[0] and m[-1]  # left padding
        text = tok.decode(batch["prompts"][i][m].tolist(), skip_special_tokens=False)
        assert row["prompt"][-1]["content"] in text and text.rstrip().endswith("assistant")
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    answers = [f"Let me think. Answer: {truths[0]}", "Answer: 123456789", "x" * 3]
    width = cfg.rollout.response_length
    responses = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), np.int32)
    for i, text in enumerate(answers):
        ids = tok.encode(text)[:width]
        responses[i, : len(ids)], mask[i, : len(ids)] = ids, 1
    gen = batch.union(Batch.from_dict({"responses": responses, "response_mask": mask}))
    fn = RewardFunction(cfg, tok)
    out = fn(gen)
    fn.close()
    lengths = mask.sum(-1)
    assert out["acc"].tolist() == [1.0, 0.0, 0.0]
    # DAPO manager: the rule score plus the eq.13 overlong penalty (L_max=16, L_cache=4), on the last token
    for i in range(3):
        penalty = min(max(((width - 4) - lengths[i]) / 4, -1.0), 0.0)
        rule = compute_score("arithmetic", tok.decode(responses[i][: lengths[i]].tolist()), truths[i])
        expected = rule + penalty
        assert out["token_level_scores"][i, lengths[i] - 1] == np.float32(expected)
        assert np.count_nonzero(out["token_level_scores"][i]) <= 1
    assert out["pred"][0] == truths[0]


def test_ptx_examples_are_prompt_response_pairs():
    cfg = load_config("safe_rlhf", preset="smoke", overrides=["data.ptx_files=[gsm8k]", "data.max_prompt_length=200"])
    tok = load_tokenizer(cfg.model.path)
    ptx = ptx_examples(cfg, tok)
    assert len(ptx) > 1000 and ptx["responses"].shape[1] == cfg.rollout.response_length
    assert ptx["prompt_mask"].sum(-1).max() <= 200
    i = 0
    assert ptx["response_mask"][i].sum() > 0
    np.testing.assert_array_equal(ptx["input_ids"][i], np.concatenate([ptx["prompts"][i], ptx["responses"][i]]))
    att = ptx["attention_mask"][i]
    assert ptx["position_ids"][i][att.astype(bool)].tolist() == list(range(int(att.sum())))


def _load_plot_module():
    spec = importlib.util.spec_from_file_location("launch_plot", os.path.join(REPO, "launch", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_writes_a_png_of_the_run_curves(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for step in range(1, 5):
            fh.write(json.dumps({"step": step, "critic/score/mean": step / 4, "response_length/mean": 10 + step,
                                 "actor/entropy": 1 / step, "actor/pg_clipfrac": 0.01 * step}) + "\n")
    with open(tmp_path / "validation.jsonl", "w") as fh:
        fh.write(json.dumps({"step": 0, "val-core/arithmetic/acc/mean@1": 0.1, "val-core/gsm8k/acc/mean@1": 0.3}) + "\n")
        fh.write(json.dumps({"step": 4, "val-core/arithmetic/acc/mean@1": 0.3, "val-core/gsm8k/acc/mean@1": 0.5}) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "plot.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out == str(tmp_path / "curves.png")
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 20_000  # four panels with text and lines, not an empty canvas
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (700, 1000) and float(pixels[..., :3].std()) > 0.05

    plot = _load_plot_module()
    series = plot.load_series(str(tmp_path))
    assert series["val:acc"] == [(0, 0.2), (4, 0.4)]  # mean over the validation datasets
    fig = plot.draw(series, title="run")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [name for name, _, _ in plot.PANELS]
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    assert len(lines) == 6 and all(ax.get_legend() is not None for ax in fig.axes)
    assert list(lines["validation accuracy, arithmetic"].get_ydata()) == [0.1, 0.3]  # one line per dataset
    assert list(lines["validation accuracy, gsm8k"].get_xdata()) == [0, 4]
    assert all(ax.get_xlabel() == "step" and ax.get_ylabel() for ax in fig.axes)


def test_plot_marks_a_panel_without_data_and_fails_clearly_without_metrics(tmp_path):
    plot = _load_plot_module()
    fig = plot.draw({"critic/score/mean": [(1, 0.5), (2, 0.7)]}, title="run")
    assert [t.get_text() for t in fig.axes[3].texts] == ["no data"] and fig.axes[3].get_legend() is None
    (tmp_path / "metrics.jsonl").write_text("")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "plot.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no records in" in proc.stderr


def _read_tfrecord_scalars(directory) -> dict[tuple[str, int], float]:
    """Scalars of a TensorBoard event file, read back from the TFRecord framing (u64 length, u32 crc, data,
    u32 crc) and the ``Event`` protobuf: an independent reader of what the logger wrote."""
    import struct

    from tensorboardX.proto import event_pb2

    files = [os.path.join(directory, f) for f in os.listdir(directory) if f.startswith("events.out.tfevents")]
    assert len(files) == 1, files
    out, data = {}, open(files[0], "rb").read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out[(value.tag, int(event.step))] = value.simple_value
    return out


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from jaxrl_hf.trainer.logging import MetricLogger

    log = MetricLogger(str(tmp_path), ["jsonl", "tensorboard"])
    log.log(1, {"critic/score/mean": 0.25, "actor/entropy": 1.5})
    log.log(2, {"critic/score/mean": 0.75, "actor/entropy": 1.25})
    log.log_validation(2, {"val-core/arithmetic/acc/mean@4": 0.5})
    log.close()
    scalars = _read_tfrecord_scalars(tmp_path / "tensorboard")
    assert scalars == {("critic/score/mean", 1): 0.25, ("actor/entropy", 1): 1.5, ("critic/score/mean", 2): 0.75,
                       ("actor/entropy", 2): 1.25,
                       ("val-core/arithmetic/acc/mean_4", 2): 0.5}  # TensorBoard tags cannot hold '@
