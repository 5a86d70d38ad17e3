"""initlab's private core: how data is read, a loss computed, a forward run, and the model left
as it was. Every public entry point goes through it; nothing here is public API."""
