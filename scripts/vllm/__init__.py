"""``bench_vs_vllm.py``'s parts: the vLLM virtualenv (``venv``), the runner that the vLLM venv's
python executes (``runner``: standard library and vLLM only, no tpserve import), the project-side
handle on that process (``client``) and the comparison's figures (``report``)."""
