"""tigon's chunked DPO loss inside TRL's DPOTrainer: the policy's and the reference's last
hidden states go to ``tigon.losses.dpo_loss`` with the lm_head weights, so the [2B, T, V]
logits of neither model are formed for the whole batch.

Run: ``python examples/dpo_with_trl.py`` (a tiny random Llama and an offline word-level
tokenizer; CPU or GPU; on the CPU it turns on Triton's interpreter itself). It trains a few
steps with TRL's own loss and with tigon's, from the same weights and data, and prints both loss
curves. For a real model, pass your model, reference model, tokenizer and dataset to
``TigonDPOTrainer`` as to ``DPOTrainer``.
"""

from __future__ import annotations

import copy
import os

import torch

# Without a GPU, tigon's kernels run in Triton's interpreter, which must be on before triton is
# first imported (trl imports it): importing tigon first would do it too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from trl import DPOConfig, DPOTrainer  # noqa: E402

from tigon.losses import dpo_loss  # noqa: E402
from tigon.losses.preference import DPO_TYPES  # noqa: E402


class TigonDPOTrainer(DPOTrainer):
    """DPOTrainer whose loss is tigon's chunked DPO (one loss type of tigon's DPO_TYPES, TRL's
    "aot_unpaired" as tigon's "aot_pair"; TRL's own loss for the rest)."""

    def _compute_loss(self, model, inputs, return_outputs):
        loss_type = self.loss_types[0] if len(self.loss_types) == 1 else None
        loss_type = "aot_pair" if loss_type == "aot_unpaired" else loss_type
        if loss_type not in DPO_TYPES or self.f_divergence_type != "reverse_kl" or self.ld_alpha \
                or self.use_weighting or (loss_type == "exo_pair" and not self.label_smoothing):
            return super()._compute_loss(model, inputs, return_outputs)
        ids, attention = inputs["input_ids"], inputs["attention_mask"]
        # Next-token targets over the completion; the last position predicts nothing.
        target = ids.masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        unwrapped = self.accelerator.unwrap_model(model)
        hidden = unwrapped.get_decoder()(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        reference = {}
        if self.precompute_ref_logps:
            reference = dict(ref_chosen_logps=inputs["ref_chosen_logps"],
                             ref_rejected_logps=inputs["ref_rejected_logps"])
        else:
            ref_model = self.accelerator.unwrap_model(self.ref_model)
            with torch.no_grad():
                ref_hidden = ref_model.get_decoder()(input_ids=ids, attention_mask=attention,
                                                     use_cache=False).last_hidden_state
            reference = dict(ref_x=ref_hidden[:, :-1], ref_weight=ref_model.get_output_embeddings().weight)
        # TRL 1.16's sigmoid has no label smoothing; its robust, exo_pair and aot types do.
        smoothing = 0.0 if loss_type == "sigmoid" else self.label_smoothing
        loss, metrics = dpo_loss(hidden[:, :-1], unwrapped.get_output_embeddings().weight, target, beta=self.beta,
                                 loss_type=loss_type, label_smoothing=smoothing,
                                 discopop_tau=self.args.discopop_tau, **reference)
        mode = "train" if model.training else "eval"
        chosen, rejected = metrics["chosen_rewards"], metrics["rejected_rewards"]
        for name, value in (("rewards/chosen", chosen.mean()), ("rewards/rejected", rejected.mean()),
                            ("rewards/accuracies", (chosen > rejected).float().mean()),
                            ("rewards/margins", (chosen - rejected).mean()),
                            ("logps/chosen", metrics["chosen_logps"].mean()),
                            ("logps/rejected", metrics["rejected_logps"].mean())):
            self._metrics[mode][name].append(value.item())
        return (loss, metrics) if return_outputs else loss


def tiny_setup():
    """A tiny random Llama, a word-level tokenizer and a preference dataset, all offline."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    words = "the cat sat on a mat and dog ran to park is good bad no yes".split()
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    data = Dataset.from_dict({
        "prompt": ["the cat", "a dog", "the park"] * 4,
        "chosen": [" sat on a mat", " ran to the park", " is good"] * 4,
        "rejected": [" no", " bad bad", " the the"] * 4,
    })
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
                                  bos_token_id=None)
    return AutoModelForCausalLM.from_config(config), tokenizer, data


def train(trainer_class, model, tokenizer, data, output_dir, steps=3, loss_type="sigmoid"):
    args = DPOConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                     seed=0, beta=0.1, loss_type=[loss_type])
    trainer = trainer_class(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                            processing_class=tokenizer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main():
    import tempfile

    model, tokenizer, data = tiny_setup()
    with tempfile.TemporaryDirectory() as tmp:
        trl_losses = train(DPOTrainer, copy.deepcopy(model), tokenizer, data, f"{tmp}/trl")
        tigon_losses = train(TigonDPOTrainer, model, tokenizer, data, f"{tmp}/tigon")
    print("TRL's DPO loss:  ", " ".join(f"{x:.5f}" for x in trl_losses))
    print("tigon's DPO loss:", " ".join(f"{x:.5f}" for x in tigon_losses))


if __name__ == "__main__":
    main()
