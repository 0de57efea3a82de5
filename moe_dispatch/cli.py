"""The ``moe-dispatch`` command: doctor, explain, bench, matrix.

Exit codes: 0 ok, 2 usage (bad flags), 1 failure (unreadable or unsupported config file,
no backend accepts, a run that failed).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence


from . import hf_config
from ._config import Activation, MoEConfig, dtype_name
from ._errors import MoEDispatchError
from ._resolver import resolve

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code for usage is 2
        self.print_usage(sys.stderr)
        self.exit(2, f"moe-dispatch: error: {message}\n")


def _tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: expected comma-separated positive ints") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: expected comma-separated positive ints")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layer (flags, or --hf-config)")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json")
    g.add_argument("--experts", type=_positive, help="number of experts E")
    g.add_argument("--top-k", type=_positive, help="experts per token K")
    g.add_argument("--hidden", type=_positive, help="hidden size H")
    g.add_argument("--intermediate", type=_positive, help="expert intermediate size I")
    g.add_argument("--activation", choices=[a.value for a in Activation], default=None)
    g.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None)
    g.add_argument("--bias", action="store_true", default=None, help="experts have biases")
    g.add_argument("--router-weight-on-input", action="store_true", default=None)
    p.add_argument("--backend", help="force a backend")
    p.add_argument("--exclude", default="", help="comma list of backends to exclude")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moe-dispatch", description="Pick and explain MoE kernels on this CPU.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    d = sub.add_parser("doctor", help="capabilities, backends, plugin failures, env")
    d.add_argument("--json", action="store_true")
    e = sub.add_parser("explain", help="which backend each MoE layer gets, and why")
    _add_config_flags(e)
    b = sub.add_parser("bench", help="time every accepting backend side by side")
    _add_config_flags(b)
    b.add_argument("--tokens", type=_tokens, default=[1, 8, 128, 512], help="e.g. 1,8,128,512")
    b.add_argument("--reps", type=_positive, default=10, help="timed calls per point (default 10)")
    b.add_argument("--plot", metavar="PNG", help="write ms against tokens, one line per backend")
    m = sub.add_parser("matrix", help="print (or --write) the generated support matrix")
    m.add_argument("--write", metavar="PATH", help="write it to PATH instead of stdout")
    return parser


def _configs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[MoEConfig, dict]]:
    """(config, info) per distinct MoE layer shape, from --hf-config or the flags."""
    if args.hf_config:
        model = hf_config.load(args.hf_config, dtype=args.dtype)
        overrides = {k: v for k, v in dict(activation=args.activation, has_bias=args.bias).items() if v}
        out = []
        for config, layers in model.layer_shapes().items():
            if overrides:
                import attrs
                config = attrs.evolve(config, **overrides)
            out.append((config, dict(family=model.family, layers=list(layers),
                                     routing=_routing_dict(model.routing), notes=list(model.notes))))
        return out
    missing = [f for f in ("experts", "top_k", "hidden", "intermediate") if getattr(args, f) is None]
    if missing:
        parser.error("give --hf-config PATH or all of --experts --top-k --hidden --intermediate "
                     f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)})")
    try:
        config = MoEConfig(args.experts, args.top_k, args.hidden, args.intermediate,
                           activation=args.activation or "silu", dtype=args.dtype or "bfloat16",
                           has_bias=bool(args.bias),
                           apply_router_weight_on_input=bool(args.router_weight_on_input))
    except MoEDispatchError as exc:
        parser.error(str(exc))
    return [(config, {})]


def _routing_dict(r: hf_config.Routing) -> dict[str, Any]:
    import attrs
    return attrs.asdict(r)


def _excludes(args: argparse.Namespace) -> list[str]:
    return [n for n in args.exclude.split(",") if n.strip()]


def _resolution_dict(res) -> dict[str, Any]:
    return dict(config=_config_dict(res.config), backend=res.backend, forced=res.forced,
                candidates=[dict(name=c.name, priority=c.priority, status=c.status,
                                 accepted=c.decision.accepted, reason=c.reason, source=c.source)
                            for c in res.candidates])


def _config_dict(c: MoEConfig) -> dict[str, Any]:
    return dict(num_experts=c.num_experts, top_k=c.top_k, hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size, activation=c.activation.value,
                dtype=dtype_name(c.dtype), has_bias=c.has_bias,
                apply_router_weight_on_input=c.apply_router_weight_on_input)


def cmd_doctor(args: argparse.Namespace) -> int:
    from ._doctor import main as doctor
    return doctor(args.json)


def cmd_explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    items = _configs(args, parser)
    results, ok = [], True
    for config, info in items:
        try:
            res = resolve(config, backend=args.backend, exclude=_excludes(args))
            results.append((config, info, res, None))
        except MoEDispatchError as exc:
            ok = False
            results.append((config, info, None, exc))
    if args.json:
        print(json.dumps([dict(**info, **(_resolution_dict(res) if res else
                                          dict(config=_config_dict(cfg), error=str(err))))
                          for cfg, info, res, err in results], indent=2))
        return 0 if ok else 1
    for config, info, res, err in results:
        if info:
            layers = info["layers"]
            print(f"{info['family']}: {len(layers)} MoE layer(s) with this shape "
                  f"(layers {layers[0]}..{layers[-1]})" if layers else f"{info['family']}: no MoE layers")
            r = info["routing"]
            print(f"routing: {r['scoring']}, renormalize={r['renormalize']}, "
                  f"groups={r['num_expert_group']}/{r['topk_group']}, "
                  f"scaling={r['routed_scaling_factor']}, correction_bias={r['correction_bias']}")
            for note in info["notes"]:
                print(f"note: {note}")
        if res is not None:
            print(res.explain())
        else:
            print(f"moe-dispatch: {err}", file=sys.stderr)
        print()
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._bench import bench_grid
    items = _configs(args, parser)
    plot_rows = []
    out = []
    for config, info in items:
        print(f"benchmarking {config.describe()} at T={args.tokens} (round-robin medians)",
              file=sys.stderr)
        backends = [args.backend] if args.backend else None
        rows = bench_grid(config, args.tokens, reps=args.reps, backends=backends,
                          exclude=_excludes(args))
        out.append(dict(config=_config_dict(config), rows=rows))
        plot_rows.append((config, rows))
        if not args.json:
            print(f"\n{config.describe()}   (* = the config-stage choice, run at every T by "
                  'policy="priority"; the default policy="auto" routes each T to the backend '
                  "it measures fastest)")
            print(f"{'T':>6}  {'backend':<14} {'median ms':>10} {'x fastest':>10}")
            for r in rows:
                mark = " *" if r["chosen"] else ""
                print(f"{r['tokens']:>6}  {r['backend'] + mark:<14} {r['median_ms']:>10.3f} {r['ratio']:>10.2f}")
    if args.json:
        print(json.dumps(out, indent=2))
    if args.plot:
        try:
            _plot(plot_rows, args.plot)
        except ImportError:
            print("moe-dispatch: --plot needs matplotlib (pip install 'moe-dispatch[plot]')", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _plot(items: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(items), figsize=(6 * len(items), 4.2), squeeze=False)
    for ax, (config, rows) in zip(axes[0], items):
        for name in dict.fromkeys(r["backend"] for r in rows):
            pts = [(r["tokens"], r["median_ms"]) for r in rows if r["backend"] == name]
            chosen = any(r["chosen"] for r in rows if r["backend"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=name + (" (config-stage choice)" if chosen else ""),
                    linewidth=2.5 if chosen else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (T)")
        ax.set_ylabel("median ms per forward")
        ax.set_title(config.describe(), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cmd_matrix(args: argparse.Namespace) -> int:
    from ._matrix import render
    text = render() + "\n"
    if args.write:
        with open(args.write, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "explain":
            return cmd_explain(args, parser)
        if args.command == "bench":
            return cmd_bench(args, parser)
        return cmd_matrix(args)
    except hf_config.HFConfigError as exc:
        print(f"moe-dispatch: {exc}", file=sys.stderr)
        return 1
    except MoEDispatchError as exc:
        print(f"moe-dispatch: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"moe-dispatch: {exc}", file=sys.stderr)
        return 1
