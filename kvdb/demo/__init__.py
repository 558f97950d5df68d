"""The worked example of embedding kvdb in an engine: ``kvdb demo`` and ``kvdb bench ttft``.

    model.py     a small random-weight transformers Llama (no download) and a quiet forward
    ttft.py      ``kvdb bench ttft``: full prefill vs suffix prefill vs restore from host / disk
    agents.py    ``kvdb demo``: a multi-agent workflow run on the model with and without kvdb
    chart.py     the PNG chart of a demo run (matplotlib, Agg backend)

Nothing here is imported by ``import kvdb``; it needs the ``transformers`` extra.
"""
