"""``python -m jaxinfer.serve [--model PATH] [--port 8000] [--api-key KEY]`` (``jaxinfer-serve``):
the OpenAI-compatible server (engine options as ``jaxinfer.generate``); HTTP here (no JAX), the
engine in an engine-core process (`client`, `core`). SIGINT/SIGTERM: stop accepting, abort all
after ``--shutdown-timeout``, stop the core; exit codes: `main`."""

import functools
import os
import signal
import sys


def build_parser():
    from jaxinfer.cli_args import engine_parser

    p = engine_parser("jaxinfer-serve", "OpenAI-compatible HTTP server over the jaxinfer engine.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model file or directory name, or "
        "the hub id)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument(
        "--max-request-bytes", type=int, default=8 << 20, help="larger request bodies get 413"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (a request's model), with --enable-lora: name=path "
        'or a JSON object {"name", "path"} each (docs/lora.md)',
    )
    p.set_defaults(precompile=None)  # on a GPU: no request waits for a compile
    return p


def _served_name(args, path: str | None) -> str | None:
    """``--served-model-name``, else vLLM's default: a hub id as given, else the model file or
    directory's name (``path``: where the core loaded it from; None: not known yet)."""
    if args.served_model_name:
        return args.served_model_name
    if args.model and not os.path.exists(args.model):  # a hub id
        return args.model
    return path and os.path.splitext(os.path.basename(os.path.normpath(path)))[0]


def main(argv: list[str] | None = None, factory=None) -> int:
    """Start the engine core on ``factory()`` (picklable, returns a `jaxinfer.LLM`; None: the
    ``--model`` and engine options of ``argv``), then serve HTTP until SIGINT/SIGTERM or the
    core's death. Returns the exit code: 0; 1: the core died; 2: bad options (a --lora-modules
    adapter refused: `check_lora_modules`, before the model loads, and with the served name once
    the core is up), or the core could not start; 130: interrupted (SIGINT, SIGTERM) while
    starting, the core stopped."""
    import uvicorn

    from jaxinfer.cli_args import fail, make_llm
    from jaxinfer.serve.app import create_app
    from jaxinfer.serve.client import EngineCoreClient
    from jaxinfer.serve.lora import check_lora_modules, parse_lora_modules

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # while the core starts: stop it too
    try:
        args = build_parser().parse_args(argv)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port} is invalid: a TCP port is 0 to 65535")
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        loras = parse_lora_modules(args.lora_modules) if args.enable_lora else None
        if loras and factory is None:  # before the model loads; again with the served name
            check_lora_modules(loras, _served_name(args, None), args.max_lora_rank)
        client = EngineCoreClient(factory or functools.partial(make_llm, args))
    except ValueError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
    try:
        app = create_app(
            client,
            served_model_name=_served_name(args, client.info["model_path"]),
            api_key=args.api_key,
            max_request_bytes=args.max_request_bytes,
            lora_modules=loras,
        )
    except ValueError as e:  # a --lora-modules adapter refused
        client.close()
        return fail(str(e))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # abort what is left after the grace period
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()  # exit 0, not re-raised
            if client.loop is not None:
                client.loop.call_soon_threadsafe(
                    client.loop.call_later, args.shutdown_timeout, client.abort_all
                )

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    client.on_death = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        client.close()
    if client.dead is not None:
        fail(client.dead)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
