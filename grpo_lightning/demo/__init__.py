"""What the learning demo and the benchmarks use beside the library: held-out accuracy, a time budget."""
