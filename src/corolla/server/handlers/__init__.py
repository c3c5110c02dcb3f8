"""Handler processes (`--num_handlers` N > 1): extra fronts in processes of their own. `handler_pool` starts them
(with the server's `front_settings.FrontSettings`); each runs the same front (`front_service.main`), whose one seam to the core is
`remote_core.RemoteCore` over the one frame codec (`protocol.channel_frames`); the device process serves each through a
`device_channel` against its one `SpanCore`, all read by one intake thread (`device_channel.ChannelIntake`) that hands decode steps
to the runtime a frame at a time."""
