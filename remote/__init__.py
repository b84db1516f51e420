"""The files llmgw runs on a node, shipped in the wheel as the package ``llmgw.remote``.

``llmgw_helper.py`` is the node helper (standard library only, Python >= 3.8; its docstring is
the protocol) and ``llmgw_vllm_guard.py`` the middleware vLLM loads on an engine port. The
control plane reads their bytes with importlib.resources and sends them to the node; it never
imports them, and this package imports nothing. The helper is edited as the modules of
``helper/``, which scripts/build-helper concatenates into ``llmgw_helper.py``; they are not shipped.
"""
