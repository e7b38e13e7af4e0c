"""The algorithm: group advantages, the loss, the trajectory it reads, and the optimizer updates on it."""
