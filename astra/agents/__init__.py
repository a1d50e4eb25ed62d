"""Agents: an OpenAI-compatible endpoint that records every token an agent's calls consume and
produce, and the trajectories built from them (issue 30). No HTTP server code: servers/agent_http.py.
"""
