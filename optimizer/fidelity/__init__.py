"""The engine against measured runs: closed-loop benchmark clients (closedloop), calibration by replay (replayfit), InferenceX's servers (inferencex) and vLLM's own scheduler replayed (parity)."""
