"""``mixprec sample``: its arguments and its run: text from a gpt checkpoint, or a minilm's ``[MASK]`` filled."""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.programs.cli.arguments import positive_int

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``mixprec sample``'s arguments."""
    sample = sub.add_parser("sample", help="generate text from a gpt checkpoint (fill [MASK] for minilm) written by "
                            "mixprec train")
    sample.add_argument("dir", help="the train --out directory, its checkpoints/ directory or one step-N directory")
    sample.add_argument("--prompt", default="\n", help="text to continue (characters of the training vocabulary); "
                        "minilm: text with one or more [MASK] tokens to fill")
    sample.add_argument("--tokens", type=positive_int, default=200, help="characters to generate (default: 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default: 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    sample.add_argument("--policy", default="fp32", help="policy the model runs under while sampling (default: fp32; "
                        "16-bit weights load exactly, saved fp32 masters are used where present)")
    sample.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")


def run(args: argparse.Namespace) -> int:
    """Print ``--tokens`` characters continuing ``--prompt`` from a gpt checkpoint (a minilm one:
    :func:`_sample_minilm`); 0."""
    import torch

    from mixprec.checkpoint.local import resolve_checkpoint
    from mixprec.checkpoint import load_model_weights, read_manifest as read_distributed_manifest
    from mixprec.engine.mixed_precision import MixedPrecision
    from mixprec.optim import SGD
    from mixprec.workloads import GPT, Corpus, GPTConfig, generate

    path = Path(args.dir)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    path = resolve_checkpoint(path)
    description = read_distributed_manifest(path)["extra"].get("workload", {})   # one-process or DCP format
    if description.get("workload") == "minilm":
        return _sample_minilm(path, description, args)
    if description.get("workload") != "gpt":
        raise ValueError(f"sample: {str(path)!r} holds a {description.get('workload')!r} checkpoint; sample needs "
                         "one from `mixprec train --workload gpt` (or minilm)")
    model_desc, vocab = description["model"], description["data"]["vocab"]
    fields = set(GPTConfig.__dataclass_fields__) - {"optim"}
    model = GPT(GPTConfig(**{k: v for k, v in model_desc.items() if k in fields}), len(vocab))
    load_model_weights(path, model)   # fp32 values (masters where saved; DCP shards gathered), then --policy
    mp = MixedPrecision(model, SGD(model.parameters(), lr=0.0), policy=args.policy, device=args.device)
    corpus = Corpus.from_text(vocab, source=str(path))
    idx = torch.tensor([corpus.encode(args.prompt)], dtype=torch.int64, device=mp.device)  # (1, T0)
    generator = torch.Generator(device=mp.device).manual_seed(args.seed)
    with mp.autocast():
        ids = generate(mp.model, idx, args.tokens, temperature=args.temperature, generator=generator)
    print(corpus.decode(ids[0].tolist()))
    return 0


def _sample_minilm(path: Path, description: dict, args: argparse.Namespace) -> int:
    """Fill each ``[MASK]`` of ``--prompt`` with the trained MiniLM's five most likely tokens."""
    import torch

    from mixprec.checkpoint import load_model_weights
    from mixprec.engine.mixed_precision import MixedPrecision
    from mixprec.optim import SGD
    from mixprec.workloads import get_workload

    lora = (description.get("model") or {}).get("lora")
    workload = get_workload("minilm", config=description.get("config"), lora=lora)
    torch.manual_seed(args.seed)
    model = workload.build_model()
    load_model_weights(path, model)
    mp = MixedPrecision(model, SGD(model.parameters(), lr=0.0), policy=args.policy, device=args.device)
    ids = [workload.cls_id, *workload.encode(args.prompt), workload.sep_id]
    if workload.mask_id not in ids:
        raise ValueError(f"sample --prompt {args.prompt!r}: a minilm checkpoint fills [MASK] tokens; put at least one "
                         "in the prompt, e.g. --prompt 'the [MASK] statement returns from a function'")
    input_ids = torch.tensor([ids], dtype=torch.int64, device=mp.device)  # (1, T)
    mp.module.eval()
    with torch.no_grad(), mp.autocast():
        logits = mp.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0]  # (T, V)
    for k, position in enumerate([i for i, t in enumerate(ids) if t == workload.mask_id], start=1):
        probs = logits[position].float().softmax(-1)
        top = probs.topk(5)
        words = ", ".join(f"{workload.decode([int(i)]).strip()} ({float(p):.2f})" for p, i in zip(top.values, top.indices))
        print(f"[MASK] {k}: {words}")
    return 0
