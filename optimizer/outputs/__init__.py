"""What a finished study leaves behind: the run folder (runfolder), the engine files (exports), the capacity review, the plots and the timeline."""
