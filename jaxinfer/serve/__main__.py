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


def main(argv: list[str] | None = None, factory=None) -> int:
    """Start the engine core on ``factory()`` (picklable, returns a `jaxinfer.LLM`; None: the
    ``--model`` and engine options of ``argv``), then serve HTTP until SIGINT/SIGTERM or the
    core's death. Returns the exit code: 0; 1: the core died; 2: bad options, or the core could
    not start; 130: interrupted (SIGINT, SIGTERM) while starting, the core stopped."""
    import uvicorn

    from jaxinfer.cli_args import fail, make_llm
    from jaxinfer.serve.app import create_app
    from jaxinfer.serve.client import EngineCoreClient
    from jaxinfer.serve.lora import parse_lora_modules

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # while the core starts: stop it too
    try:
        args = build_parser().parse_args(argv)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port} is invalid: a TCP port is 0 to 65535")
        if args.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        loras = parse_lora_modules(args.lora_modules) if args.enable_lora else None
        client = EngineCoreClient(factory or functools.partial(make_llm, args))
    except ValueError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
    path, hub_id = client.info["model_path"], args.model and not os.path.exists(args.model)
    name = args.served_model_name or (
        args.model
        if hub_id  # vLLM's default name: the hub id as given
        else path and os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    )
    app = create_app(
        client,
        served_model_name=name,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        lora_modules=loras,
    )

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
