"""``deepinfer-gateway bench``: load any OpenAI-compatible URL and measure it the way operators compare engines.

A package of its own, beside ``gateway``: the server never imports it (the CLI's ``bench`` command does, lazily),
and the Docker image does not ship it. It is not named ``bench``, which is the repository's directory of benchmark
scripts.

One module per job: ``config`` (what to run, parsed from the command line), ``workload`` (which requests),
``client`` (one streamed request, timed), ``arrivals`` (how requests are offered: concurrency or Poisson arrivals,
in one or several processes), ``metrics`` (TTFT, TPOT, ITL, E2E, throughput, goodput, cost), ``report`` (terminal,
JSON, Markdown), ``plots`` (PNG, needs the ``bench`` extra) and ``runner`` (ties them together). Two yardsticks
run on their own: ``fake_upstream`` (a nearly free OpenAI server) and ``capacity`` (one client process's ceiling).
"""
