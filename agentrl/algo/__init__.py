"""Policy-gradient math: advantage estimators and loss terms, as pure tensor functions."""
