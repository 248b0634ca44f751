"""jaxrl_hf: reinforcement learning for LLMs on JAX/XLA in the HybridFlow design.

Sub-packages, one concern each:
  algos/       pure-function advantage estimators, policy/value losses, KL estimators, DAPO pieces
  models/      flax Llama/Qwen2 decoder, weight import/export, tokenizer
  rollout/     generation engines (native JAX, vLLM)
  controller/  single controller: resource pools, worker groups, transfer protocols, Batch
  workers/     actor/critic/reference/reward workers
  trainer/     the RL control flow per algorithm
  rewards/     rule scorers and reward managers
  data/        datasets and resumable loaders
  placement/   auto device mapping (HybridFlow Algorithm 1)
"""

__version__ = "0.1.0"
