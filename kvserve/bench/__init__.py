"""`kvserve bench`: measure any OpenAI-compatible server (serve), the LLM API (offline), and
this machine's roof (roofline)."""
