"""The pieces of bench/soak.py (the entry point: its docstring says what is checked and
the pass criteria), one noun per module:

- progress: the stderr log and elapsed seconds;
- outcome: how one request ended (Outcome) and the counts per kind (Tally);
- conn: client WebSockets (WsConn), their pools (WsPool, CheckoutPool), one exchange;
- context: the run's shared state (Ctx) and the prompts;
- messages: generate messages and HTTP bodies of the mix;
- ws_kinds, http_kinds: the well-formed request kinds and how each is judged;
- malformed: malformed frames and bodies (BAD_FRAMES, BAD_BODIES) and their judges;
- mix: the kinds by weight and the seeded plan of a run;
- load: running the plan under deadlines, and the client's tallies (Client);
- procs: RSS and process trees from /proc;
- watch: /metrics scraping, the Sampler and the leak check;
- probes: the disconnect probes;
- stopwatch: timed plain completions and latency figures;
- trigger: the hostile chat template and the template-trigger phase;
- flood: the tokenize flood;
- fault: SIGKILL to the worker under load (without restarts: /health and refusals);
- restart: the worker's replacement after the kill;
- replica: SIGKILL to one replica's worker of a two-replica server;
- server: the server's flags, its shutdown and its log;
- phases: the order of the phases and the client-side record;
- verdict: the pass criteria applied to the report, RSS growth;
- summary, plot: the printed summary and the PNG.
"""
