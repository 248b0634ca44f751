"""verl's dotted keys on the fine-tuning entry points: rewritten into their options, unknown keys refused."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from jaxrl_hf.finetune.dotted_args import to_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser(script: str):
    spec = importlib.util.spec_from_file_location(f"{script}_cli_dotted", os.path.join(REPO, "launch", f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build_parser()


def test_verl_sft_keys_set_the_same_options_as_the_flags():
    parser = _parser("train_sft")
    dotted = ["trainer.default_local_dir=runs/sft", "optim.lr=2e-5", "data.train_batch_size=4",
              "+model.partial_pretrain=tiny", "model.lora_rank=8", "model.target_modules=[q_proj, v_proj]",
              "data.train_files=['rows.parquet']", "data.max_length=256", "optim.clip_grad=0.5",
              "model.enable_gradient_checkpointing=false", "trainer.resume_mode=auto", "trainer.total_training_steps=3"]
    flags = ["--out", "runs/sft", "--lr", "2e-5", "--batch-size", "4", "--model", "tiny", "--lora-rank", "8",
             "--target-modules", "q_proj,v_proj", "--data", "rows.parquet", "--max-length", "256",
             "--max-grad-norm", "0.5", "--remat", "none", "--resume", "--steps", "3"]
    assert vars(parser.parse_args(to_flags(parser, dotted, "train_sft"))) == vars(parser.parse_args(flags))
    mixed = to_flags(parser, ["--preset", "smoke", "optim.lr=1e-3", "trainer.resume_mode=disable"], "train_sft")
    assert mixed == ["--preset", "smoke", "--lr", "1e-3"]


@pytest.mark.parametrize("script", ["train_sft", "train_dpo", "train_rm", "train_prm"])
def test_a_key_the_entry_point_lacks_is_refused_with_the_ones_it_takes(script):
    parser = _parser(script)
    with pytest.raises(SystemExit, match=r"unknown key 'optim\.betas'.*'optim\.lr'") as err:
        to_flags(parser, ["optim.betas=[0.9,0.95]"], script)
    assert "trainer.default_local_dir" in str(err.value)
    args = parser.parse_args(to_flags(parser, ["trainer.default_local_dir=o", "optim.lr=0.5", "trainer.seed=3"], script))
    assert (args.out, args.lr, args.seed) == ("o", 0.5, 3)


def test_bad_values_name_the_key():
    parser = _parser("train_sft")
    with pytest.raises(SystemExit, match="trainer.resume_mode='resume_path'"):
        to_flags(parser, ["trainer.resume_mode=resume_path"], "train_sft")
    with pytest.raises(SystemExit, match="model.enable_gradient_checkpointing='maybe': expected true or false"):
        to_flags(parser, ["model.enable_gradient_checkpointing=maybe"], "train_sft")
