"""The search and everything a user touches: study, exports, plots and the CLI."""
