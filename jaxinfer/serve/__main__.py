"""``python -m jaxinfer.serve [--model PATH] [--port 8000] [--api-key KEY]`` (``jaxinfer-serve``):
the OpenAI-compatible server, engine options as ``jaxinfer.generate``. Bad options: one line on
stderr, exit code 2. SIGINT/SIGTERM: stop accepting, abort all after ``--shutdown-timeout``."""

import os
import sys
import threading


def build_parser():
    from jaxinfer.cli_args import engine_parser

    p = engine_parser("jaxinfer-serve", "OpenAI-compatible HTTP server over the jaxinfer engine.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file or directory name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code (0; 2: bad options or model)."""
    import uvicorn

    from jaxinfer.cli_args import fail, make_llm
    from jaxinfer.serve.app import create_app

    try:
        args = build_parser().parse_args(argv)
        llm = make_llm(args)
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
    name = args.served_model_name or os.path.splitext(os.path.basename(
        os.path.normpath(llm.model_path)))[0]
    app = create_app(llm, served_model_name=name, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # abort what is left after the grace period
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()  # exit 0, not re-raised
            timer = threading.Timer(args.shutdown_timeout, app.state.runner.stop)
            timer.daemon = True
            timer.start()

    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
