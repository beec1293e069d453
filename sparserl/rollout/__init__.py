"""The env loop that drives an engine: `worker.rollout` (turns, tokenization of env text, loss masks, rewards),
episodes and env modules, tool-call parsing and chat rendering, and the OpenReward client and local server."""
