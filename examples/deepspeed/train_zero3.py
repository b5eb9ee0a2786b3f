"""Train a tigon-patched Llama with DeepSpeed ZeRO-3 through HF Trainer, on every GPU of the host:

    torchrun --nproc-per-node 2 examples/deepspeed/train_zero3.py            # tigon
    torchrun --nproc-per-node 2 examples/deepspeed/train_zero3.py --no-tigon  # plain HF, to compare

Every parameter, the output head's included, is partitioned over the ranks (``zero3.json``: no
optimizer section, so Trainer's torch AdamW runs inside DeepSpeed). tigon's fused loss runs
inside the head's forward, where ZeRO-3 has gathered the head's weight, and its gradient reaches
the weight through the head's own call, as an nn.Linear's would. A random-init Llama (random
tokens as data, the same seed for both runs) trains ``--steps`` optimizer steps of
``--accumulation`` micro-batches each; rank 0 prints the losses and, with ``--out``, writes them
as JSON. Needs ``pip install deepspeed accelerate``.
"""

import argparse
import json
import os
import time

import torch
import transformers

import tigon

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-tigon", action="store_true", help="plain HF (no tigon.patch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=2, help="sequences per GPU per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--config", default=os.path.join(HERE, "zero3.json"), help="the DeepSpeed config")
    p.add_argument("--out", default=None, help="write the losses and timings here (JSON)")
    args = p.parse_args()

    # TrainingArguments first: with ZeRO-3 in it, from_config builds the model already partitioned.
    training = transformers.TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tigon_zero3"), deepspeed=args.config,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, bf16=True,
        gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        disable_tqdm=True)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=128256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    if not args.no_tigon:
        report = tigon.patch(model)
        if training.process_index == 0:
            print(report)

    n_rows = args.steps * args.accumulation * args.batch * training.world_size
    ids = torch.randint(0, config.vocab_size, (n_rows, args.seq), generator=torch.Generator().manual_seed(1))
    dataset = [dict(input_ids=row, labels=row) for row in ids]
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if training.process_index == 0:
        shape = getattr(model.lm_head.weight, "ds_shape", None)
        print(f"lm_head weight: {tuple(model.lm_head.weight.shape)} on this rank (partitioned by ZeRO-3: "
              f"{shape is not None}, full shape {tuple(shape) if shape is not None else '-'})")
        print(f"{'plain HF' if args.no_tigon else 'tigon'}: {args.steps} steps in {seconds:.1f} s, peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB on GPU 0, losses "
              + " ".join(f"{x:.4f}" for x in losses))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(tigon=not args.no_tigon, losses=losses, seconds=seconds, world=training.world_size,
                               peak_gib=torch.cuda.max_memory_allocated() / 2**30, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
