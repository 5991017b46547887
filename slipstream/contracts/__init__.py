"""Contract checks of our code against the exact upstream releases we pin (``pins.py``), on CPU.

vLLM, SGLang, NIXL and megatron-core change their APIs between minor versions; a field we send that a
release renamed is often dropped silently (vLLM's request models accept unknown fields). So the
checker compares our real calls with the pinned releases' own source:

* ``cache.py`` fetches each release once (``pip download --no-deps``) and keeps its Python sources;
* ``upstream.py`` reads them with ``ast`` (nothing upstream is installed or imported);
* ``ours.py`` records what our clients, adapters and launcher actually send;
* ``http.py``, ``flags.py``, ``pyapi.py`` check HTTP requests, launch flags and Python API use;
* ``descriptions.py`` checks the server descriptions (``slipstream.serverapi``) against upstream routes
  and that every request we send goes to an endpoint its description names;
* ``check.py`` runs them all; ``python -m slipstream.contracts`` prints the report.

To pin a new release: for vLLM or SGLang change ``version`` in its description
(``slipstream/serverapi/<kind>.py``), for the others its row in ``pins.py``; then the pyproject extra
and ``docs/contracts.md``; run ``make contracts`` and fix what it reports. To check a new endpoint or flag: nothing to do if our code sends it through a
client, adapter or launcher the recorder already drives; a new client or adapter needs a few lines in
``ours.py``. See ``docs/contracts.md``.
"""
