"""What a run reports: metric rows through reporters (CSV, TensorBoard, plug-ins), plots of
runs and sweeps, heat-maps, the partition picture and the neuron-matching measure."""
