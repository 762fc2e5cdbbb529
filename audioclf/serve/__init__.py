"""`audioclf serve`: a trained model behind a micro-batched HTTP server, with a page to try it.

    service = Service.open("runs/demo_cnn/best.pt", gallery="data/demo/index.xlsx")
    run(build_app(service), listen("127.0.0.1", 8000))     # until SIGTERM / Ctrl-C

Modules:
    service   the model, its micro-batcher, the gallery and collection it answers from (no HTTP)
    batcher   MicroBatcher: clips of concurrent requests embedded in batches, a bounded queue
    stats     the Prometheus text of GET /metrics
    app       the Starlette app: the endpoints, the request limits, the page (page.html)
    server    uvicorn on a socket bound first, and a stop on SIGTERM / Ctrl-C that exits 0
    cli       audioclf serve / python -m audioclf.serve

app and server need the [serve] extra (starlette, uvicorn, python-multipart, prometheus_client); service, batcher
and stats need only audioclf's own requirements. docs/serving.md is the manual.
"""
