"""``bench_served_vs_vllm.py``'s parts: the servers it starts one at a time (``servers``), aiperf in
its own virtualenv (``aiperf``), the ``openai``-client load generator (``load``), the prompts
(``prompts``) and tpserve's offline engine on the same load (``offline``)."""
