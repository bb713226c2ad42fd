"""How a config is assembled, checked and judged on resume. JAX-free: config files import it."""
