"""A tigon-patched tiny Llama trained on two ranks (gloo on the CPU under the interpreter, NCCL
on two GPUs) against one process training on the same global batch: data-parallel under DDP and
FSDP2 (``fully_shard`` per decoder layer and the root; the head as its own unit; tied
embeddings), gradient accumulation with ``num_items_in_batch`` counted over every rank and
micro-batch, as HF Trainer does; and a tensor-parallel head (ColwiseParallel over the
vocabulary, HF's "colwise_rep": tigon's vocab-parallel fused loss) with the whole batch on each
rank. Each rank compares its loss and every parameter's gradient (the norms' weights
included; FSDP2's sharded gradients gathered) with the single-process ones, then takes an SGD
step and compares the next loss. One job of two processes runs every case; the default test run
takes DEFAULT_CASES (each wrapping, tied embeddings and accumulation once), --exhaustive all."""


import contextlib
import functools

import torch

from tests.helpers import ON_GPU, run_on_ranks

WORLD = 2
GLOBAL_ROWS, SEQ, VOCAB = 4, 16, 512
TOL = 1e-4  # fp32, relative to each gradient's largest element; the ranks' sums differ in order only

# name: (wrapping, tied embeddings, micro-batches per rank)
CASES = {
    "ddp": ("ddp", False, 1),
    "ddp_tied_accumulated": ("ddp", True, 2),
    "fsdp2": ("fsdp2", False, 1),
    "fsdp2_head_unit": ("fsdp2_head", False, 1),
    "fsdp2_tied": ("fsdp2", True, 1),
    "fsdp2_accumulated": ("fsdp2_head", False, 2),
    "tp_head": ("tp_head", False, 1),
}
DEFAULT_CASES = ("ddp_tied_accumulated", "fsdp2_accumulated", "tp_head")


def build(tied, device):
    import transformers

    import tigon

    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=160, vocab_size=VOCAB, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.config.use_cache = False
    tigon.patch(model)
    with torch.no_grad():  # the norms' weights away from 1, so their gradients mean something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.train()


def global_batch(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven token counts across ranks and micro-batches
    labels[3, 9:] = -100
    return ids.to(device), labels.to(device)


def n_items(labels):
    return int((labels[:, 1:] != -100).sum())


def full_grads(model):
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP2: this rank's shard of a DTensor
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().clone()
    return grads


@functools.cache  # per rank process: each (tied, device) once for all its cases
def single_process(tied, device):
    """(loss, grads, next loss) of one process on the whole batch."""
    model = build(tied, device)
    ids, labels = global_batch(device)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = full_grads(model)
    torch.optim.SGD(model.parameters(), lr=0.5, foreach=False).step()  # plain and DTensor parameters mixed
    with torch.no_grad():
        again = model(input_ids=ids, labels=labels).loss
    return float(loss), grads, float(again)


def wrap(model, how, device):
    if how == "tp_head":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (WORLD,))
        parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if ON_GPU else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if how == "fsdp2_head":
        fully_shard(model.lm_head, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def distributed(rank, how, tied, micro, device):
    """(loss, grads, next loss) over the ranks. Data-parallel: this rank's half of the batch, in
    ``micro`` micro-batches with gradients synchronised on the last; each micro-batch's loss is
    its token sum over the global token count, times the world size (DDP and FSDP2 average
    gradients). Tensor-parallel head: the whole batch on every rank."""
    import torch.distributed as dist

    model = build(tied, device)
    wrapped = wrap(model, how, device)
    ids, labels = global_batch(device)
    total = n_items(labels)
    split = WORLD if how != "tp_head" else 1
    rows = GLOBAL_ROWS // split
    mine = range(rank * rows, (rank + 1) * rows) if split > 1 else range(GLOBAL_ROWS)
    step = rows // micro
    loss_sum = torch.zeros((), device=device)
    for i in range(micro):
        last = i == micro - 1
        part = slice(mine.start + i * step, mine.start + (i + 1) * step)
        sync = wrapped.no_sync() if how == "ddp" and not last else contextlib.nullcontext()
        if how.startswith("fsdp2"):
            wrapped.set_requires_gradient_sync(last)
        with sync:
            loss = wrapped(input_ids=ids[part], labels=labels[part], num_items_in_batch=total).loss * split
            loss.backward()
        loss_sum += loss.detach() / WORLD  # tensor parallel: every rank's loss is the whole loss
    dist.all_reduce(loss_sum)
    grads = full_grads(model)
    torch.optim.SGD(model.parameters(), lr=0.5, foreach=False).step()  # plain and DTensor parameters mixed
    with torch.no_grad():
        again = wrapped(input_ids=ids[mine.start:mine.stop], labels=labels[mine.start:mine.stop],
                        num_items_in_batch=total).loss.detach() * split
    dist.all_reduce(again)
    return float(loss_sum), grads, float(again) / WORLD


def compare(rank, name, device):
    how, tied, micro = CASES[name]
    ref_loss, ref_grads, ref_again = single_process(tied, device)
    loss, grads, again = distributed(rank, how, tied, micro, device)
    problems = []
    for what, got, want in (("loss", loss, ref_loss), ("loss after a step", again, ref_again)):
        if not abs(got - want) <= TOL * abs(want):
            problems.append(f"{what} {got} != {want}")
    for pname, want in ref_grads.items():
        got = grads.get(pname)
        if got is None or want is None:
            if (got is None) != (want is None):
                problems.append(f"{pname}: gradient {'missing' if got is None else 'unexpected'}")
            continue
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))
        if not err <= TOL:  # NaN fails too
            problems.append(f"{pname}: relative error {err:.2e}")
    return "ok" if not problems else "; ".join(problems[:4])


def rank_cases(names, rank, device):
    return {name: functools.partial(compare, rank, name, device) for name in names}


def test_two_ranks_train_like_one_process(request):
    names = tuple(CASES) if request.config.getoption("--exhaustive") else DEFAULT_CASES
    results = run_on_ranks(functools.partial(rank_cases, names), WORLD, timeout_s=600)
    failed = {f"{name} (rank {rank})": r[name] for rank, r in enumerate(results) for name in names if r[name] != "ok"}
    assert not failed, failed
