"""An OTLP/HTTP traces endpoint that accepts and drops what it gets: the other end of
`urc gateway --otel-endpoint` in bench/gateway_overhead.py --variants otel.

    python bench/otlp_sink.py   # prints `sink: http://127.0.0.1:PORT`, serves until SIGTERM"""

import asyncio
import signal

from aiohttp import web


async def main() -> None:
    posts = 0

    async def traces(request: web.Request) -> web.Response:
        nonlocal posts
        await request.read()
        posts += 1
        return web.Response(body=b"", content_type="application/x-protobuf")  # an empty answer

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"sink: http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(f"sink: {posts} exports received", flush=True)
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
