"""Tree topologies, the banks that hold them and the plan one generate call decodes with."""
