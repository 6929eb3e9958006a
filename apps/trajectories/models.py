# Episodes and steps arrive with the trajectories issue.
