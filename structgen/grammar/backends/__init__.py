"""Grammar backends: adapters around xgrammar and llguidance behind `base.GrammarBackend`."""
