"""`kvserve bench`: measure any OpenAI-compatible server (serve), the LLM API (offline),
this machine's roof (roofline) and its kernels' ISA level and GEMV speed (kernels)."""
