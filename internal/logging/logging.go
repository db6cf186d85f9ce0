// Package logging builds the daemons' structured loggers from flags.
package logging

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
)

// Options are the logging flags.
type Options struct {
	// Level is debug, info, warn or error.
	Level string
	// Format is logfmt or json.
	Format string
}

// RegisterFlags defines --log.level and --log.format on fs.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Level, "log.level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&o.Format, "log.format", "logfmt", "log format: logfmt or json")
}

// New returns a logger writing to w as o says.
func New(w io.Writer, o Options) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.Level)); err != nil {
		return nil, fmt.Errorf("--log.level: %w", err)
	}
	ho := &slog.HandlerOptions{Level: level}
	switch o.Format {
	case "logfmt", "":
		return slog.New(slog.NewTextHandler(w, ho)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, ho)), nil
	}
	return nil, fmt.Errorf("--log.format: must be logfmt or json, got %q", o.Format)
}
