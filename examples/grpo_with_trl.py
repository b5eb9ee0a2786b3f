"""tigon's chunked GRPO loss inside TRL's GRPOTrainer: the policy's last hidden states at the
completion positions go to ``tigon.losses.grpo_loss`` with the lm_head weight, which forms the
logits a chunk of sequences at a time and the gradients in the same pass.

Run: ``python examples/grpo_with_trl.py`` (a tiny random Llama, an offline word-level tokenizer,
a toy reward and TRL's DAPO length penalty; CPU or GPU; on the CPU it turns on Triton's
interpreter itself). It trains a few steps with TRL's own loss and with tigon's, from the same
weights, data and seed, and prints both runs' losses and gradient norms. For a real model, pass
your model, reward functions, tokenizer, dataset and GRPOConfig to ``TigonGRPOTrainer`` as to
``GRPOTrainer`` (one line changes).
"""

from __future__ import annotations

import copy
import os

import torch

# Without a GPU, tigon's kernels run in Triton's interpreter, which must be on before triton is
# first imported (trl imports it): importing tigon first would do it too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

from tigon.losses import grpo_loss  # noqa: E402

TIGON_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


class TigonGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is tigon's chunked GRPO (TRL 1.16's formulas and logged metrics).
    TRL's own loss runs where tigon's does not cover the setting: other loss types, entropy
    masking or bonus, off-policy masks, MoE auxiliary losses, multimodal inputs, soft-capped or
    scaled logits."""

    def _tigon_covers(self, model, inputs):
        config = model.config.get_text_config()
        return (self.loss_type in TIGON_LOSS_TYPES and self.top_entropy_quantile >= 1.0
                and self.off_policy_mask_threshold is None and not self._entropy_bonus_enabled
                and not self.aux_loss_enabled and inputs.get("pixel_values") is None
                and inputs["advantages"].dim() == 1
                and getattr(config, "final_logit_softcapping", None) is None
                and getattr(config, "logit_scale", None) in (None, 1.0))

    def _compute_loss(self, model, inputs):
        unwrapped = self.accelerator.unwrap_model(model)
        if not self._tigon_covers(unwrapped, inputs):
            return super()._compute_loss(model, inputs)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        n_completion = completion_ids.size(1)
        # The mixed precision accelerate gives the model's own forward (the decoder called directly
        # does not get it), also for tigon's head: its matmuls run in autocast's dtype.
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(self.accelerator.mixed_precision))
        autocast = torch.autocast(input_ids.device.type, dtype=dtype, enabled=dtype is not None)
        with autocast:
            hidden = unwrapped.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                             use_cache=False).last_hidden_state
        x = hidden[:, -n_completion - 1:-1]  # the positions that predict the completion tokens
        head = unwrapped.get_output_embeddings()
        mode = "train" if self.model.training else "eval"
        items = None
        if self.loss_type in ("dapo", "cispo"):  # TRL's normaliser for these two
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        use_ratio = self.use_vllm and self.vllm_importance_sampling_correction
        with autocast:
            loss, metrics = grpo_loss(
                x, head.weight, completion_ids, mask, inputs["advantages"], head.bias,
                ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                old_per_token_logps=inputs.get("old_per_token_logps"), beta=self.beta, epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, delta=self.args.delta, loss_type=self.loss_type,
                importance_sampling_level=self.importance_sampling_level,
                max_completion_length=self.max_completion_length, temperature=self.temperature,
                importance_sampling_ratio=inputs["importance_sampling_ratio"] if use_ratio else None,
                num_items_in_batch=items, use_bias_correction_kl=self.args.use_bias_correction_kl,
                sapo_temperature_pos=self.args.sapo_temperature_pos,
                sapo_temperature_neg=self.args.sapo_temperature_neg,
                compute_entropy=True)
        if self.loss_type not in ("dapo", "cispo") and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        for name, value in metrics.items():  # per-process means, averaged over processes
            if value.ndim == 0:
                self._metrics[mode][name].append(self.accelerator.gather(value.reshape(1)).nanmean().item())
        return loss


def tiny_setup():
    """A tiny random Llama, a word-level tokenizer, prompts and a reward, all offline."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    words = "the cat sat on a mat and dog ran to park is good bad no yes".split()
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                        padding_side="left")
    data = Dataset.from_dict({"prompt": ["the cat", "a dog", "the park", "no yes"] * 4})
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
                                  bos_token_id=None)
    return AutoModelForCausalLM.from_config(config), tokenizer, data


def reward_variety(completions, **kwargs):
    """The toy reward: how many different words a completion uses."""
    return [float(len(set(c.split()))) for c in completions]


def train(trainer_class, model, tokenizer, data, output_dir, steps=3, loss_type="dapo", beta=0.04, **config):
    """Train from model's weights; returns the logged loss, grad_norm, kl and entropy per step. The
    model goes to the trainer as a saved folder, from which TRL also builds the reference model.
    Plain SGD: Adam would turn the last-digit differences of two fp32 computations of a zero
    gradient (policy = reference at step one) into full-size steps, and the samples would part."""
    model.save_pretrained(f"{output_dir}/init")
    args = GRPOConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=0.5, optim="sgd", logging_steps=1, save_strategy="no",
                      report_to=[],
                      use_cpu=not torch.cuda.is_available(), seed=0, beta=beta, loss_type=loss_type, **config)
    # A toy reward and one of TRL's own: DAPO's soft overlong punishment (lengths past 4 of the 8 tokens)
    rewards = [reward_variety, get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)]
    trainer = trainer_class(model=f"{output_dir}/init", reward_funcs=rewards, args=args, train_dataset=data,
                            processing_class=tokenizer)
    trainer.train()
    return [{k: h[k] for k in ("loss", "grad_norm", "kl", "entropy") if k in h}
            for h in trainer.state.log_history if "loss" in h]


def main():
    import argparse
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast (GRPOConfig(bf16=False))")
    args = p.parse_args()
    config = dict(loss_type=args.loss_type, **(dict(bf16=False) if args.fp32 else {}))
    model, tokenizer, data = tiny_setup()
    with tempfile.TemporaryDirectory() as tmp:
        trl_log = train(GRPOTrainer, copy.deepcopy(model), tokenizer, data, f"{tmp}/trl", **config)
        tigon_log = train(TigonGRPOTrainer, model, tokenizer, data, f"{tmp}/tigon", **config)
    print(f"loss_type {args.loss_type}, {'fp32' if args.fp32 else 'bf16 autocast (GRPOConfig default)'}")
    for name in ("loss", "grad_norm", "kl", "entropy"):
        print(f"{name:9s} TRL:  ", " ".join(f"{h.get(name, float('nan')):.6f}" for h in trl_log))
        print(f"{name:9s} tigon:", " ".join(f"{h.get(name, float('nan')):.6f}" for h in tigon_log))


if __name__ == "__main__":
    main()
