"""Handler processes (`--num_handlers` N > 1): extra fronts in processes of their own. `handler_pool` starts them
(with the server's `front_service.FrontSettings`); each `handler_process` runs the same front, whose one seam to the core is
`remote_core.RemoteCore` over the one frame codec (`protocol.channel_frames`); the device process serves each through a
`device_channel` against its one `SpanCore`, all read by one intake thread (`device_channel.ChannelIntake`) that hands decode steps
to the runtime a frame at a time."""
