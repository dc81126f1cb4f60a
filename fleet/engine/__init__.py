"""The vector engine: many clients trained as one batched computation (the agent's math, step for step)."""
