"""PPO and GRPO over Hugging Face causal LMs (docs/design.md §9).

functional  the algorithms' maths: advantages, KL, policy and value losses
logprobs    token log-probabilities and entropies from logits, in bounded memory
batch       a step's sequences and their micro-batch layout (shared-prompt rows)
packing     which sequences share a row and a micro-batch (FLOP estimate, token budget)
models      the critic, the forward passes, and what a model supports
trainer     PPOTrainer: one rank's train step over the models
"""
